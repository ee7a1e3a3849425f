"""The applications built on the trainer: the benchmark, the HF baselines, the efficiency suite, the launch check and
the command-line pieces of the tools in tools/.

The rule (docs/architecture.md): an app imports the core package, never the reverse. No module of the trainer imports
anything under litespark_megatron.apps (tests/test_ground_floor.py checks it), so a change here cannot change what a
training run does.
"""
