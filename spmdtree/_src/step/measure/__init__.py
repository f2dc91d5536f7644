"""Held against the devices present (new in 0.7): a step run and profiled beside
its prediction (`measure`), and the chip's own figures measured (`calibrate`)."""
