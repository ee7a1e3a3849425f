from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="litespark-megatron",
    version="0.1.0",
    description="3D-parallel Llama pretraining on Megatron-Core with Litespark attention and MLP",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["litespark_megatron", "litespark_megatron.*"]),
    python_requires=">=3.12",
    install_requires=[
        # The trainer is megatron-core's megatron.training (shipped in the wheel since 0.17; Python >= 3.12).
        "megatron-core==0.19.2",
        "torch>=2.6",
        "numpy",
        "psutil",  # dist_checkpointing's torch_dist writer needs it but does not declare it
        "pyyaml",
        "tensorboard",
        "tokenizers",
        # Megatron-LM's --tokenizer-type HuggingFaceTokenizer (the usual Llama tokenizer) loads through it, and the
        # benchmark's HF baselines run on it.
        "transformers",
        "nvidia-ml-py",
    ],
    extras_require={
        "te": ["transformer-engine[pytorch]==2.20.2"],
        # liger-kernel: the benchmark's hf-liger peer (its checks run on a CPU too); peft: HF peft, the tests' oracle
        # of --peft lora|dora (the exported adapter loaded with it).
        # torchao: the inference benchmark's int4 variants, which its tests quantize a tiny model with.
        "dev": ["pytest>=7", "pytest-xdist>=3", "matplotlib", "liger-kernel==0.8.5", "peft==0.21.2",
                "torchao==0.18.0"],
        "bench": ["liger-kernel==0.8.5"],
        # tools/inference_bench.py: int4 weight-only (RTN, HQQ, AWQ) and float8 variants (torchao has no
        # dependencies; its int4 kernels are aten's). NF4 needs bitsandbytes besides, not required.
        "inference": ["torchao==0.18.0"],
        # Megatron-LM's --wandb-project / --wandb-exp-name / --wandb-save-dir log to Weights & Biases.
        "wandb": ["wandb"],
        # litespark-convert: Hugging Face Llama checkpoints in and out (transformers is a dependency already).
        "hf": ["transformers", "safetensors", "tqdm"],
        # --attention-variant nsa on a GPU: fla-core's NSA Triton kernels (layers/nsa.py follows this version's
        # definition; einops is its one dependency). Not needed on a CPU, which runs the plain-torch reference.
        "nsa": ["fla-core==0.6.0"],
    },
    entry_points={
        "console_scripts": [
            "litespark-train=litespark_megatron.pretrain:main",
            "litespark-preprocess=litespark_megatron.corpus:preprocess_main",
            "litespark-convert=litespark_megatron.hf_convert:main",
            "litespark-plan=litespark_megatron.apps.plan:main",
        ],
    },
)
