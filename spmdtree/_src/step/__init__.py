"""The whole step on hardware you don't have, in floors (0.7): kinds, then hlo and hw,
then compile and time, then preflight, measure and advise (CONTRIBUTING's map)."""
