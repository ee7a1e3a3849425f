from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="litespark-megatron",
    version="0.1.0",
    description="3D-parallel Llama pretraining on Megatron-Core with Litespark attention and MLP",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["litespark_megatron", "litespark_megatron.*"]),
    python_requires=">=3.10",
    install_requires=[
        # megatron-core >= 0.17 needs Python 3.12; 0.16.1 has wheels for 3.11 and 3.12.
        "megatron-core==0.16.1",
        "torch>=2.6",
        "numpy",
        "psutil",  # dist_checkpointing's torch_dist writer needs it but does not declare it
        "pyyaml",
        "tensorboard",
        "tokenizers",
        "nvidia-ml-py",
    ],
    extras_require={
        "te": ["transformer-engine[pytorch]==2.20.2"],
        "dev": ["pytest>=7", "matplotlib"],
    },
    entry_points={
        "console_scripts": [
            "litespark-train=litespark_megatron.training.loop:main",
            "litespark-preprocess=litespark_megatron.corpus:preprocess_main",
        ],
    },
)
