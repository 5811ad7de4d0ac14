"""kpipe.agent"""
