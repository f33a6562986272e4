"""The record format and the bytes around it: headers, encoding, decoding, batch buffers,
sample-id packing, the keyed tag and the HTTP batch framing."""
