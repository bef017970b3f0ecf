"""Programs that tests start as separate worker processes."""
