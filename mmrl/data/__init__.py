"""Data that samplers draw from: prompt datasets (:mod:`mmrl.data.prompts`)."""
