"""`kvcap ab`: a same-caliber A/B of two arms from one experiment file (`experiment`)."""
