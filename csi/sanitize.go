package csi

import (
	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// sanitize renders a request for a log with every field the CSI spec
// marks csi_secret replaced by "***stripped***" (as
// kubernetes-csi/csi-lib-utils' protosanitizer does).
func sanitize(req any) string {
	m, ok := req.(proto.Message)
	if !ok {
		return ""
	}
	c := proto.Clone(m)
	strip(c.ProtoReflect())
	b, err := protojson.MarshalOptions{}.Marshal(c)
	if err != nil {
		return ""
	}
	return string(b)
}

func strip(m protoreflect.Message) {
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		opts := fd.Options()
		if opts != nil && proto.HasExtension(opts, csipb.E_CsiSecret) && proto.GetExtension(opts, csipb.E_CsiSecret).(bool) {
			if fd.IsMap() {
				stripped := m.NewField(fd).Map()
				v.Map().Range(func(k protoreflect.MapKey, _ protoreflect.Value) bool {
					stripped.Set(k, protoreflect.ValueOfString("***stripped***"))
					return true
				})
				m.Set(fd, protoreflect.ValueOfMap(stripped))
			} else {
				m.Set(fd, protoreflect.ValueOfString("***stripped***"))
			}
			return true
		}
		switch {
		case fd.IsList() && fd.Message() != nil:
			l := v.List()
			for i := 0; i < l.Len(); i++ {
				strip(l.Get(i).Message())
			}
		case fd.IsMap() && fd.MapValue().Message() != nil:
			v.Map().Range(func(_ protoreflect.MapKey, mv protoreflect.Value) bool {
				strip(mv.Message())
				return true
			})
		case fd.Message() != nil && !fd.IsMap() && !fd.IsList():
			strip(v.Message())
		}
		return true
	})
}
