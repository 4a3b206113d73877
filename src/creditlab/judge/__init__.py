"""creditlab.judge"""
