"""Time: the roofline bound and the predicted step time over the one walk."""
