package nbd

import (
	"context"
	"log/slog"
	"testing"
)

// nullDevice accepts every write and reads zeroes, so that a benchmark
// measures the serving path's own cost.
type nullDevice struct{ size uint64 }

func (d nullDevice) ReadAt(_ context.Context, p []byte, _ int64) error { clear(p); return nil }
func (nullDevice) WriteAt(context.Context, []byte, int64, bool) error  { return nil }
func (nullDevice) WriteZeroes(context.Context, int64, int64, bool) error {
	return nil
}
func (nullDevice) Trim(context.Context, int64, int64) error { return nil }
func (nullDevice) Flush(context.Context) error              { return nil }
func (d nullDevice) Size() uint64                           { return d.size }

// BenchmarkKernelWrite1MiB sends 1 MiB WRITEs at queue depth 1 over a
// socket pair, as the kernel's NBD client does once attached.
func BenchmarkKernelWrite1MiB(b *testing.B) {
	s := newTestServer(b, nullDevice{size: 64 << 20}, func(c *Config) { c.Logger = slog.New(slog.DiscardHandler) })
	c, _ := serveTransmission(b, context.Background(), s, "mem")
	p := pattern(1<<20, 1)
	b.SetBytes(int64(len(p)))
	b.ReportAllocs()
	for b.Loop() {
		if e := c.write(0, p, 0); e != 0 {
			b.Fatalf("write: %v", e)
		}
	}
}
