"""The compiled module: its instructions parsed once, walked once, its reading a fold."""
