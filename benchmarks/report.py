"""Benchmark records as markdown tables: `aiayn bench report [DIR] [--bench NAME] [--update FILE ...]`.

One table a benchmark, one row a record (benchmarks/record.py writes them), each row with its date, machine
(CPU model, family/model, the ISA flags that matter), threads and load, the figures, versions and commit.
The README and the guides hold rendered tables between `<!-- bench-table: NAME -->` and
`<!-- /bench-table -->`; `--update FILE` rewrites those blocks from the records, and
`tests/benchmarks/test_record.py` checks that each committed block equals its rendering. A folder without records,
or one that would leave a block without a row, is refused before any file is written; a file that is not a record
is skipped with a line naming it.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from record import ISA_FLAGS, RESULTS_DIR, load  # benchmarks/record.py

# Which figures a benchmark's table shows, as (column, figure name); the record keeps every figure.
COLUMNS = {
    "encoder": (("aiayn", "aiayn Encoder"), ("plain modules", "aiayn Encoder, plain modules"),
                ("torch fast path", "torch TransformerEncoder (fast path)"),
                ("aiayn / fast path", "aiayn Encoder / fast path"),
                ("share of matmul peak", "aiayn Encoder, share of peak")),
    "embed": (("aiayn", "aiayn"), ("sentence-transformers", "sentence-transformers"),
              ("aiayn / sentence-transformers", "aiayn throughput vs sentence-transformers"),
              ("aiayn int8", "aiayn int8"), ("aiayn batch 1", "aiayn (batch 1)"),
              ("BertModel batch 1", "HF BertModel (sdpa) (batch 1)")),
    "generate": (("greedy, batch 1: aiayn fp32", "aiayn fp32 (search greedy, batch 1)"),
                 ("CTranslate2 fp32", "CTranslate2 fp32 (search greedy, batch 1)"),
                 ("fp32 / CT2", "fp32 vs CT2 (search greedy, batch 1)"),
                 ("aiayn fp32, share of the memory bound",
                  "aiayn fp32 (search greedy, batch 1, measure share of the memory bound)"),
                 ("CT2 fp32, share of the bound",
                  "CTranslate2 fp32 (search greedy, batch 1, measure share of the memory bound)"),
                 ("int8 / CT2 int8", "int8 vs CT2 (search greedy, batch 1)"),
                 ("beam 4, batch 1: fp32 / CT2", "fp32 vs CT2 (search beam-4, batch 1)"),
                 ("int8 / CT2 int8", "int8 vs CT2 (search beam-4, batch 1)"),
                 ("greedy, batch 32: fp32 / CT2", "fp32 vs CT2 (search greedy, batch 32)"),
                 ("beam 4, batch 32: fp32 / CT2", "fp32 vs CT2 (search beam-4, batch 32)")),
    "train": (("aiayn", "aiayn"), ("Hugging Face Marian", "Hugging Face Marian"),
              ("aiayn / Marian", "aiayn / Hugging Face Marian"), ("torch.nn.Transformer", "torch.nn.Transformer"),
              ("aiayn / torch.nn.Transformer", "aiayn / torch.nn.Transformer"),
              ("aiayn, 2 processes (DDP) / Marian", "aiayn, processes (DDP) / Hugging Face Marian (processes 2)")),
    "decoder_only": (("aiayn", "aiayn (model decoder-only)"),
                     ("plain modules", "aiayn, plain modules (model decoder-only)"),
                     ("Hugging Face GPT-2", "Hugging Face GPT-2 (model decoder-only)"),
                     ("aiayn / GPT-2", "aiayn / Hugging Face GPT-2 (model decoder-only)")),
    "lm": (("aiayn bits/char", "aiayn, valid bits"), ("nanoGPT bits/char", "nanoGPT, valid bits"),
           ("aiayn steps", "aiayn, steps"), ("nanoGPT steps", "nanoGPT, steps"),
           ("aiayn chars/s", "aiayn, training chars"), ("nanoGPT chars/s", "nanoGPT, training chars")),
    "finetune": (("aiayn", "aiayn (model encoder)"), ("plain modules", "aiayn, plain modules (model encoder)"),
                 ("Hugging Face BERT", "Hugging Face BERT (model encoder)"),
                 ("aiayn / BERT", "aiayn / Hugging Face BERT (model encoder)"),
                 ("aiayn / BERT under bf16 autocast", "aiayn / Hugging Face BERT, bf16 autocast (model encoder)")),
}
# Tables of one model of a benchmark that times several (its figures labelled `model`): (benchmark, model). Any
# other table shows the records whose figures carry no such label.
TABLES = {"finetune": ("train", "encoder"), "decoder_only": ("train", "decoder-only")}
# The versions a benchmark's figures depend on besides torch: the peers it runs.
PEERS = {"generate": ("ctranslate2", "transformers"), "train": ("transformers",),
         "translate": ("transformers", "sacrebleu"), "embed": ("sentence-transformers", "transformers")}
ISA_NAMES = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_vnni": "VNNI", "avx512_bf16": "BF16",
             "amx_bf16": "AMX-BF16", "amx_int8": "AMX-INT8"}
BLOCK = re.compile(r"(<!-- bench-table: (\w+) -->\n)(.*?)(<!-- /bench-table -->)", re.S)


def machine(record: dict) -> str:
    """`AMD EPYC (family 23 model 49): AVX2; 1 of 2 cores`: what decides which kernels are fast."""
    cpu = record["cpu"]
    isa = " + ".join(ISA_NAMES[f] for f in ISA_FLAGS if cpu["isa"].get(f)) or "no AVX2"
    emulated = f", emulated {cpu['env']['ONEDNN_MAX_CPU_ISA']}" if cpu.get("env", {}).get("ONEDNN_MAX_CPU_ISA") else ""
    cores = record["cores"]
    return (f"{cpu['model']} (family {cpu['family']} model {cpu['model_number']}): {isa}{emulated}; "
            f"{cores['usable']} of {cores['logical']} cores")


def value(fig: dict) -> str:
    """A figure as the scripts print it: `1,628 tokens/s`, `1.013x`, `82.7%`."""
    v, unit = fig["value"], fig["unit"]
    if unit == "x":
        return f"{v:.3f}x"
    if unit == "%":
        return f"{v:.1f}%"
    if unit in ("bits/char", "nats/char"):  # a loss, whose second and third decimals are the difference
        return f"{v:.3f} {unit}"
    return f"{v:,.0f} {unit}" if abs(v) >= 100 else f"{v:.1f} {unit}"


def key(fig: dict) -> str:
    """A figure's column: its name, with its labels (`aiayn fp32 (search greedy, batch 1)`)."""
    labels = ", ".join(f"{k} {v}" for k, v in fig.items() if k not in ("name", "value", "unit"))
    return f"{fig['name']} ({labels})" if labels else fig["name"]


def model_of(record: dict) -> str | None:
    """The `model` label of a record's figures (`bench train --model encoder`), or None."""
    return next((f["model"] for f in record["figures"] if "model" in f), None)


def render(table: str, records: list[dict]) -> str:
    """The markdown table `table` (a benchmark's name, or one of `TABLES`) of its records, oldest first."""
    bench, model = TABLES.get(table, (table, None))
    rows = [r for r in records if r["bench"] == bench and model_of(r) == model]
    names = COLUMNS.get(table) or tuple((key(f), key(f)) for f in (rows[0]["figures"] if rows else []))
    head = ["date (UTC)", "machine", "threads, load", "command", *(column for column, _ in names), "versions"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        figures = {key(f): f for f in r["figures"]}
        cells = [value(figures[name]) if name in figures else "-" for _, name in names]
        versions = ", ".join(f"{p} {r['versions'][p]}" for p in ("torch", *PEERS.get(bench, ())) if p in r["versions"])
        load = f"{r['load_before'][0]:.2f} -> {r['load_after'][0]:.2f}"
        settings, named, args = r["command"].partition(f"aiayn bench {bench}")
        args = (" ".join(part for part in (settings.strip(), args.strip()) if part) if named
                else r["command"]) or "(defaults)"
        date = (r["date"] or "unknown").replace("T", " ")[:16]
        cells = [date, machine(r), f"{r['threads']}, load {load}", f"`{args}`", *cells,
                 f"{versions}; aiayn {r.get('commit') or '?'}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def update(text: str, records: list[dict]) -> str:
    """`text` with every marked block replaced by its rendering."""
    return BLOCK.sub(lambda m: m.group(1) + render(m.group(2), records) + m.group(4), text)


# The figures a decoding plot shows: aiayn's speed over CTranslate2's in the same precision, by setting.
DECODE_RATIOS = (("greedy, batch 1", "search greedy, batch 1"), ("beam 4, batch 1", "search beam-4, batch 1"),
                 ("greedy, batch 32", "search greedy, batch 32"), ("beam 4, batch 32", "search beam-4, batch 32"))


def _pyplot():
    """matplotlib's pyplot drawing to files, not to a screen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    """Write `fig` to `path` as a PNG and free it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def plot_decoding(records: list[dict], path: Path) -> Path:
    """A PNG of every decoding record's speed over CTranslate2 (fp32 and int8) by setting, one group of bars per
    record (its date, time and machine), with 1.0x marked: the same figures as the table, for a reader who looks."""
    plt = _pyplot()

    rows = [r for r in records if r["bench"] == "generate" and any(f["name"].endswith("vs CT2") for f in r["figures"])]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)
    width = 0.8 / max(len(rows), 1)
    for ax, precision in zip(axes, ("fp32", "int8")):
        for i, r in enumerate(rows):
            figures = {key(f): f["value"] for f in r["figures"]}
            values = [figures.get(f"{precision} vs CT2 ({labels})", 0.0) for _, labels in DECODE_RATIOS]
            label = f"{(r['date'] or '')[:16].replace('T', ' ')}, {machine(r).split(';')[0]}"  # runs of one day apart
            ax.bar([x + i * width for x in range(len(DECODE_RATIOS))], values, width, label=label)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([x + width * (len(rows) - 1) / 2 for x in range(len(DECODE_RATIOS))],
                      [name for name, _ in DECODE_RATIOS], fontsize=8)
        ax.set_title(f"aiayn {precision} / CTranslate2 {precision} (tokens/s, 1 thread)", fontsize=9)
    axes[0].set_ylabel("speed ratio (1.0 = level)")
    axes[0].legend(fontsize=7, loc="lower left")
    return _save(fig, path)


def plot_learning(records: list[dict], path: Path) -> Path:
    """A PNG of each translation record's validation BLEU against training minutes, aiayn and its peer trained
    alike on the same corpus (`aiayn bench translate --budget B --curve C`), one panel per record."""
    plt = _pyplot()

    rows = [r for r in records if r["bench"] == "translate" and any("minutes" in f for f in r["figures"])]
    fig, axes = plt.subplots(1, max(len(rows), 1), figsize=(5.5 * max(len(rows), 1), 3.6), squeeze=False)
    for ax, r in zip(axes[0], rows):
        for name in dict.fromkeys(f["name"] for f in r["figures"] if "minutes" in f):
            points = sorted((f["minutes"], f["value"]) for f in r["figures"] if f["name"] == name and "minutes" in f)
            ax.plot([0, *(m for m, _ in points)], [0, *(b for _, b in points)], marker="o", label=name)
        ax.set_xlabel("training minutes")
        ax.set_ylabel("validation BLEU (greedy)")
        threads = f"{r['threads']} thread{'' if r['threads'] == 1 else 's'}"
        given = " ".join(word for word in (r.get("command") or "").split()[3:] if "=" in word and "/" not in word)
        ax.set_title(f"{(r['date'] or '')[:10]}, {machine(r).split(';')[0]}, {threads}" + (f"\n{given}" if given
                                                                                          else ""), fontsize=8)
        ax.legend(fontsize=8)
    return _save(fig, path)


def found(directory: Path) -> list[dict]:
    """The records in `directory`; none at all (a missing or empty folder, or only files skipped) is refused."""
    if not directory.is_dir():
        what = "is not a folder" if directory.exists() else "does not exist"
        raise ValueError(f"{directory} {what}: give the folder of benchmark records (default benchmarks/results/)")
    records = load(directory)
    if not records:
        raise ValueError(f"{directory} holds no benchmark records (*.json): give the folder `aiayn bench NAME "
                         "--record` wrote them to (default benchmarks/results/)")
    return records


def keep_rows(path: Path, text: str, records: list[dict], directory: Path) -> None:
    """Refuse to rewrite a table of `path` that the records of `directory` would leave without a row."""
    for match in BLOCK.finditer(text):
        bench, model = TABLES.get(match.group(2), (match.group(2), None))
        if not any(r["bench"] == bench and model_of(r) == model for r in records):
            raise ValueError(f"{directory} holds no records for the {match.group(2)} table of {path}; rewriting it "
                             "would empty it: give the folder that holds them (default benchmarks/results/)")


def main(argv: list[str] | None = None) -> int:
    """Print the tables, or rewrite the marked blocks of the given files; returns 0."""
    p = argparse.ArgumentParser(prog="aiayn bench report", description=__doc__.splitlines()[0])
    p.add_argument("directory", nargs="?", type=Path, default=RESULTS_DIR, help="records (default benchmarks/results/)")
    p.add_argument("--bench", help="only this benchmark's table")
    p.add_argument("--update", nargs="+", type=Path, metavar="FILE", help="rewrite the bench-table blocks of FILE")
    p.add_argument("--plot-decoding", type=Path, metavar="PNG", help="draw the decoding records' ratios to PNG")
    p.add_argument("--plot-learning", type=Path, metavar="PNG", help="draw the translation records' BLEU curves")
    args = p.parse_args(argv)
    records = found(args.directory)
    if args.plot_decoding or args.plot_learning:
        for path, plot in ((args.plot_decoding, plot_decoding), (args.plot_learning, plot_learning)):
            if path:
                print(f"wrote {plot(records, path)}")
        return 0
    if args.update:
        texts = {path: path.read_text(encoding="utf-8") for path in args.update}
        for path, text in texts.items():  # every file checked before any is written
            keep_rows(path, text, records, args.directory)
        for path, text in texts.items():
            new = update(text, records)
            if new != text:
                path.write_text(new, encoding="utf-8")
                print(f"updated {path}")
        return 0
    benches = {r["bench"] for r in records}
    if args.bench:
        if args.bench not in benches | set(TABLES):
            raise ValueError(f"{args.directory} holds no records of --bench {args.bench}: it holds "
                             f"{', '.join(sorted(benches | set(TABLES)))}")
        benches = {args.bench}
    for table in sorted(benches | {t for t, (bench, _) in TABLES.items() if bench in benches}):
        print(f"## {table}\n\n{render(table, records)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
