"""fa2tune inside other libraries' models: `fa2tune.integrations.transformers` registers fa2tune as a Hugging Face
transformers attention implementation (docs/API.md, "Hugging Face transformers"). Importing this package imports
none of those libraries."""
