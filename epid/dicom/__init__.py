"""The door to the clinic: DICOM RT Plans and RT Images in and out.

``plan`` reads RT Plans onto control points and writes synthetic arcs as plans; ``image`` writes
frames as RT Images and reads measured frames onto the 1 mm grid.
"""
