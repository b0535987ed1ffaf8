"""The model's parts, one concept a file."""

from aiayn.nn.attention import AttentionCache, KVCache, MultiHeadAttention, attention_weights
from aiayn.nn.embedding import LearnedPositionalEmbedding, SinusoidalPositionalEncoding, TokenEmbedding
from aiayn.nn.feedforward import PositionwiseFeedForward
from aiayn.nn.heads import MaskedLMHead, SequenceClassificationHead, TokenClassificationHead, VocabularyHead
from aiayn.nn.layers import DecoderLayer, EncoderLayer, SublayerConnection
from aiayn.nn.masks import causal_mask, padding_mask
from aiayn.nn.model import Decoder, DecoderOnlyModel, Encoder, EncoderDecoderModel, EncoderModel, build_model

__all__ = [
    "AttentionCache", "KVCache", "MultiHeadAttention", "attention_weights", "LearnedPositionalEmbedding",
    "SinusoidalPositionalEncoding", "TokenEmbedding", "PositionwiseFeedForward", "MaskedLMHead",
    "SequenceClassificationHead", "TokenClassificationHead", "VocabularyHead", "DecoderLayer",
    "EncoderLayer", "SublayerConnection", "causal_mask", "padding_mask", "Decoder", "Encoder",
    "DecoderOnlyModel", "EncoderDecoderModel", "EncoderModel", "build_model",
]
