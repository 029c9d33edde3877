"""Data that samplers and supervised steps draw from: prompt datasets
(:mod:`mmrl.data.prompts`), SFT data sources (:mod:`mmrl.data.sources`) and the
preference-pair file format (:mod:`mmrl.data.preferences`). Demo worlds live in
:mod:`mmrl.tasks`."""
