"""creditlab.lab"""
