"""spmdtree's implementation; the public names are re-exported by `spmdtree`."""
