"""Install DeepSeek-V4.1-Flash for Hugging Face Transformers."""

from setuptools import find_packages, setup

setup(
    name="deepseek-v41-transformers",
    version="0.1.0",
    description="DeepSeek-V4.1-Flash (CSA2, Engram, mHC, DSpark, vision) for Hugging Face Transformers",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["modeling_deepseek_v41", "modeling_deepseek_v41.*", "processing", "conversion_scripts",
                                    "training"]),
    package_data={"processing": ["*.jinja"]},
    install_requires=[
        "torch>=2.8,<3",
        "transformers>=5.24,<5.25",
        "accelerate>=1.10",
        "safetensors>=0.6",
        "tokenizers>=0.22",
        "pillow>=10",
        "numpy>=1.26",
    ],
    extras_require={
        "test": ["pytest>=8", "peft==0.21.2", "parameterized==0.9.0", "triton>=3.4; platform_system == \"Linux\""],
        "train": ["peft==0.21.2"],
        "bench": ["matplotlib>=3.8"],
    },
    entry_points={
        "console_scripts": [
            "deepseek-v41-make-random-checkpoint=conversion_scripts.make_random_checkpoint:main",
        ]
    },
)
