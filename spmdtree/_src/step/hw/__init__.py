"""The hardware: chips as data, a `Hardware` that carries every figure of its chip."""
