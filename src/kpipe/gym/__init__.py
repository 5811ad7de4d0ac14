"""kpipe.gym"""
