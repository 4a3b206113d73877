"""creditlab.envs"""
