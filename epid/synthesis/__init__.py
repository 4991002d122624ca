"""Synthetic VMAT deliveries and the EPID frames they produce (design sections 3 and 4).

``geometry`` (imager and MLC grids), ``mlc`` (clinical MLCs as data), ``sequences`` (control
points of each dataset ID: ``generate_control_points``, ``pattern_for``), ``kernel`` (the detector
response), ``physics`` (ideal and realistic presets), ``fluence`` (apertures and their fluence:
``rasterize``) and ``frames`` (convolution, lag, backscatter and noise: ``render_frames``,
``convolve``).
"""
