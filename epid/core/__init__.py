"""The ground floor: what every other room uses and which knows nothing of EPIDs.

``errors`` (``InputError``, the one-line errors users see), ``parsers`` (how an ``EPID_*`` value
is read), ``devices`` (device and precision choice, CPU features), ``files`` (atomic writes),
``tables`` (plain-text tables), ``cli`` (the entry scripts' shared main and output folders), ``fft``
(real 2-D FFTs of padded images), ``memory`` (the C allocator kept from handing memory back) and
``background`` (calls run by a worker process while the caller computes on).
"""
