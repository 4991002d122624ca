"""The training data path: which arcs, which samples, which frames.

``sharding`` (dataset selection and rank assignment), ``windows`` (samples, splits and batch
windows), ``dataset`` (``EpidData``: control points kept packed, frames rendered or read per
window; ``Batch``; the loader), ``cache`` (the float16 frame cache) and ``plans`` (training arcs
from a folder of RT Plans).
"""
