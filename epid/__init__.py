"""epid: synthetic VMAT deliveries, EPID frames and cross-trained forward/inverse models."""
