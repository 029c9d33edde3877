"""The shapes world: scenes, prompts and renderer (:mod:`.world`), the verifier and its
rewards (:mod:`.rewards`), verifier-labelled preference pairs (:mod:`.pairs`), the SFT
data source of rendered ground truth (:mod:`.sft`) and the frozen image encoder trained on
its renders (:mod:`.encoder`, the ``adversarial`` reward's features)."""
