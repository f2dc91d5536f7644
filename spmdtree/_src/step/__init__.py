"""The whole step on hardware you don't have: trace, compile, read, time, advise."""
