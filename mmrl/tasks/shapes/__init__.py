"""The shapes world: scenes, prompts and renderer (:mod:`.world`), the verifier and its
rewards (:mod:`.rewards`), verifier-labelled preference pairs (:mod:`.pairs`) and the SFT
data source of rendered ground truth (:mod:`.sft`)."""
