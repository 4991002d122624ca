"""How good a model or a delivery is: gamma, per-sample metrics, quality on held-out arcs, whole-arc
reviews, plan QA, checkpoint comparison and the figures of each.

``gamma`` (``gamma_index``, pass rates; the search in ``gamma_search``), ``inference`` (samples,
predictions, per-sample metrics), ``quality`` (figures on held-out arcs), ``arc_review`` (whole
arcs reconstructed and scored), ``plan_qa`` (a plan's frames predicted, delivery QA),
``compare`` / ``compare_report`` / ``histories`` / ``weights_diff`` (checkpoints side by side),
``plots`` and ``comparison_plots`` (figures).
"""
