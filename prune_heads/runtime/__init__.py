"""How the work runs: counted in FLOPs rather than timed (`work`, the price of passes; `ledger`, the work of each
stage of a run), shared across data-parallel processes (`parallel`), and with freed memory handed back between
batches (`memory`)."""
