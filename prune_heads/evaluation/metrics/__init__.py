"""Local `evaluate` metric modules, so the basic metrics work with no network."""
