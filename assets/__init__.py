"""Data files shipped with mmrl: MJCF scenes and small weights made by mmrl."""
