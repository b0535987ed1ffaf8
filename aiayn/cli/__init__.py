"""The command-line tool: thin wrappers that parse arguments and call the library."""
