// Package logging builds the *slog.Logger of every stor binary from its
// --log-format and --log-level flags: "text" (slog's key=value lines, the
// default) or "json" (one JSON object per line, for log collectors).
package logging

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
)

// Formats accepted by New.
const (
	FormatText = "text"
	FormatJSON = "json"
)

// ErrFormat is returned by New for a format other than text or json.
var ErrFormat = errors.New("logging: unknown log format")

// FormatUsage is the flags' help text.
const FormatUsage = `log line format: "text" (key=value) or "json" (one JSON object per line)`

// New returns a logger writing to w in format at level ("debug", "info",
// "warn" or "error").
func New(w io.Writer, format, level string) (*slog.Logger, error) {
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level %q: want debug, info, warn or error", level)
	}
	opts := &slog.HandlerOptions{Level: lvl}
	switch format {
	case FormatText:
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case FormatJSON:
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	}
	return nil, fmt.Errorf("%w: --log-format %q: want %q or %q", ErrFormat, format, FormatText, FormatJSON)
}
