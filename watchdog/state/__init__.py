"""State that outlives a moment: the catalog, the ledger, the runtime state;
and how each is written."""
