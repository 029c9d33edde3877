"""The arithmetic task: addition prompts with worked completions (:mod:`.world`), the
reasoning-answer consistency reward (:mod:`.rewards`) and correct/incorrect completion
pairs (:mod:`.pairs`)."""
