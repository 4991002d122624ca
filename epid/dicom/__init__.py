"""The door to the clinic: DICOM RT Plans and RT Images in and out.

``files`` reads and writes DICOM files (bare data sets without a preamble included); ``plan``
reads RT Plans onto control points and writes synthetic arcs as plans, ``mlc_devices`` reading
a beam's MLC devices; ``image`` writes frames as RT Images and reads measured frames
onto the 1 mm grid; ``series`` reads measured images as clinics record them.
"""
