"""hybridserve.engine"""
