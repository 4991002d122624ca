"""Control points from frames: the inverse network's estimate, refined by tracking leaf and jaw
edges through the frames with the forward model's physics.

``estimate`` (the methods: network, pair, arc; ``pair_estimate``, ``reconstruct_arc``), ``rows``
(the row domain both trackers share: Wiener-filtered leaf-row profiles and row sums),
``leaves`` (leaf edges tracked by exact chain dynamic programming), ``jaws`` (jaw edges from
the row sums, once the leaves are found) and ``fallback`` (the fit kept only where the frames
agree with it better than with the network's estimate).
"""
