"""MiniGrid with text actions and an image of the agent's view: an env for vision-language agents."""
