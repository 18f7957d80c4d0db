"""Adapters that let a host which has not adopted kvwire's API call it with its own signatures."""
