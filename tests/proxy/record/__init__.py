"""proxy/record/: what makes a call durable: the writer, the journal, the store, AIR, credit."""
