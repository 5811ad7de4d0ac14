"""kpipe.train"""
