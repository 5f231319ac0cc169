"""Integrations with other libraries, each an opt-in module that imports its library itself.

``tsdecode.integrations.transformers``: tsdecode as the decode attention of Hugging Face
transformers' continuous batching (``model.generate_batch``). Importing ``tsdecode`` or this
package never imports transformers.
"""
