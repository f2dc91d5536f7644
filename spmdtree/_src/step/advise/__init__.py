"""Choosing a layout: candidates, their plans and compiles, ranked, said in words."""
