"""OpenAI's audio format names -> the public API's AudioFormat, and the media type of each."""

from omni.v1 import omni_pb2

F = omni_pb2
# chat's audio.format and speech's response_format ("pcm16" and "pcm": raw 24 kHz PCM16, OpenAI's own rate too).
AUDIO_FORMATS = {
    "wav": F.AUDIO_FORMAT_WAV, "mp3": F.AUDIO_FORMAT_MP3, "flac": F.AUDIO_FORMAT_FLAC, "opus": F.AUDIO_FORMAT_OPUS,
    "aac": F.AUDIO_FORMAT_AAC, "pcm16": F.AUDIO_FORMAT_PCM16, "pcm": F.AUDIO_FORMAT_PCM16,
}
MEDIA_TYPES = {
    "wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac", "opus": "audio/ogg; codecs=opus",
    "aac": "audio/aac", "pcm16": "audio/pcm", "pcm": "audio/pcm",
}
