"""Questions about shapes images for vision-language policies (:mod:`.world`): its prompt
sets and images, built on the shapes world."""
