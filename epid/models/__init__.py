"""The networks: the forward model (control point to frame) and the inverse model (frame pair to
control point), in two families, with their loss and checkpoints.

``aperture`` (the default family: aperture renderer with a learned detector response, leaf-edge
reader), ``legacy`` (the design's original networks), ``layers`` (CPU speed rewrites of layers),
``families`` (families, sizes, ``CrossModel``), ``losses`` (the cross-training loss) and
``checkpoint`` (atomic checkpoints, ``load_checkpoint``, ``build_models_from_checkpoint``).
"""
