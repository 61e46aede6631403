"""How the work runs: counted in FLOPs rather than timed (`work`), shared across data-parallel processes
(`parallel`), and with freed memory handed back between batches (`memory`)."""
