"""Data that samplers draw from: prompt datasets (:mod:`mmrl.data.prompts`) and the synthetic
shapes world's prompts and ground-truth images (:mod:`mmrl.data.shapes`)."""
