"""replay: conversation/v1 export and import, scenario writing, sim-vs-real comparison.

Built by a later issue; reads data through collector's store read API.
"""
