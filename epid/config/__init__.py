"""A run's configuration: every ``EPID_*`` variable, declared once, read once, validated.

``variables`` declares the variables (name, default, meaning, example, parser) in sections;
``load`` joins them into the frozen ``Config``, reads them from the environment
(``load_config``), applies the model family's recipe and writes the help, the README table and
the start-of-run description. It sits above the data and model rooms because it names their
families, physics presets and datasets; the rooms below take plain arguments, never a Config.
"""
